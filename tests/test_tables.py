"""Tables (`data: {source: table}`): CSV and Parquet files written here give the same batches, the
examples are the rows encoded with the training split's statistics and vocabularies, which the run
keeps (RUN/table.json) and resume and evaluate read back; exact resume; the demo MLP learns from a
CSV; bad columns and values are clear, located errors."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from flowctl.cli.main import cli  # noqa: E402
from flowctl.data import InputSpec, make_source  # noqa: E402
from flowctl.data import tables  # noqa: E402
from flowctl.data.tables import NEEDS, TableEncoding  # noqa: E402
from flowctl.engine.errors import CheckpointError, SpecError  # noqa: E402
from flowctl.spec.loader import load_spec  # noqa: E402
from flowctl.training.inputs import TABLE  # noqa: E402
from flowctl.training.trainer import Trainer  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "specs" / "demo.yaml"
NUMERIC = [f"x{i}" for i in range(12)] + ["age"]
FEATURES = NUMERIC + ["color"]  # 13 standardised values and a one-hot of 3: the demo's 16 inputs
COLORS = np.array(["red", "green", "blue"])
CLASSES = np.array(["cat", "dog", "eel", "fox"])
INPUTS = [InputSpec("features", (16,), "float32"), InputSpec("label", (), "int32", 4)]
DATA = {"source": "table", "features": FEATURES, "categorical": ["color"], "label": "animal"}


def rows(n: int, seed: int = 0, shift: float = 0.0) -> dict[str, np.ndarray]:
    """A learnable table: the label is a fixed linear teacher's choice over the features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 12)) + shift
    age = rng.integers(18, 80, size=n)
    color = COLORS[rng.integers(0, 3, size=n)]
    teacher = np.random.default_rng(99).normal(size=(12, 4))
    score = x @ teacher + 1.5 * (color == "red")[:, None] * np.eye(4)[0] + ((age - 50) / 10.0)[:, None] * np.eye(4)[1]
    out = {f"x{i}": x[:, i] for i in range(12)}
    return {**out, "age": age, "color": color.astype("U12"), "animal": CLASSES[score.argmax(1)].astype("U12")}


def write(cols: dict[str, np.ndarray], path: Path) -> Path:
    """The columns as CSV (floats as repr, so they read back exactly) or Parquet."""
    if path.suffix == ".parquet":
        pq.write_table(pa.table({k: pa.array(v.tolist()) for k, v in cols.items()}), path)
        return path
    names = list(cols)
    with open(path, "w") as f:
        f.write(",".join(names) + "\n")
        for i in range(len(cols[names[0]])):
            f.write(",".join(repr(float(cols[k][i])) if cols[k].dtype.kind == "f" else str(cols[k][i])
                             for k in names) + "\n")
    return path


def expected(cols: dict[str, np.ndarray], train: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The examples the rows should become, computed in float64 from the training rows `train`."""
    parts = []
    for c in NUMERIC:
        v, t = cols[c].astype(np.float64), train[c].astype(np.float64)
        parts.append(((v - t.mean()) / t.std())[:, None])
    vocab = sorted(set(train["color"].tolist()))
    parts.append(np.array([[float(c == w) for w in vocab] for c in cols["color"]]))
    classes = sorted(set(train["animal"].tolist()))
    return np.concatenate(parts, axis=1), np.array([classes.index(a) for a in cols["animal"]])


def spec_text(data: str, batch: int = 16) -> str:
    """specs/demo.yaml reading `data`, in batches of `batch`."""
    text = DEMO.read_text()
    line = next(s for s in text.splitlines() if s.startswith("data:"))
    assert "batch_size: 64" in text
    return text.replace(line, data).replace("batch_size: 64", f"batch_size: {batch}")


TABLE_DATA = """\
data:
  source: table
  path: table.csv
  features: [x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, age, color]
  categorical: [color]
  label: animal
  validation_fraction: 0.25
  seed: 5"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    write(rows(160), tmp_path / "table.csv")
    p = tmp_path / "table.yaml"
    p.write_text(spec_text(TABLE_DATA))
    return p


def train(spec_file: Path, run_dir: Path, steps: int, resume: bool = False) -> Trainer:
    t = Trainer(load_spec(spec_file), run_dir, steps=steps, prefetch=0)
    try:
        t.restore() if resume else t.start_fresh(spec_file.read_text(), str(spec_file))
        t.train()
    finally:
        t.close()
    return t


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_the_demo_mlp_trains_from_a_csv_and_its_loss_falls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    csv = write(rows(1200), tmp_path / "table.csv")
    data = ("data={source: table, path: " + str(csv) + ", features: [" + ", ".join(FEATURES)
            + "], categorical: [color], label: animal, validation_fraction: 0.2}")
    r = CliRunner().invoke(cli, ["train", str(DEMO), "--set", data, "--set", "training.steps=150",
                                 "--set", "training.eval_every_steps=150", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    loss = losses(tmp_path / "run")
    assert len(loss) == 150
    assert np.mean(loss[-10:]) < 0.5 * np.mean(loss[:10])
    final = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["val/accuracy"] > 0.5  # four classes: chance is about 0.25
    stored = json.loads((tmp_path / "run" / TABLE).read_text())
    assert stored["classes"] == sorted(CLASSES.tolist()) and stored["categorical"] == {"color": sorted(COLORS.tolist())}


def test_csv_and_parquet_give_the_same_batches(tmp_path):
    cols = rows(100)
    batches = {}
    for name in ("t.csv", "t.parquet"):
        write(cols, tmp_path / name)
        cfg = {**DATA, "path": name, "validation_fraction": 0.2, "seed": 3}
        train_src = make_source(cfg, INPUTS, 16, base_dir=tmp_path)
        val = make_source(cfg, INPUTS, 16, base_dir=tmp_path, split="validation")
        batches[name] = [train_src.next_batch() for _ in range(12)] + [val.next_batch()]  # into a second epoch
    for a, b in zip(batches["t.csv"], batches["t.parquet"]):
        for k in a:
            assert a[k].dtype == b[k].dtype
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_examples_seen_are_the_rows_encoded_with_the_training_split(tmp_path, suffix):
    cols = rows(100, seed=4)
    write(cols, tmp_path / f"t{suffix}")
    cfg = {**DATA, "path": f"t{suffix}", "validation_fraction": 0.2, "shuffle": False}
    train_rows = {k: v[:80] for k, v in cols.items()}
    x, y = expected(cols, train_rows)
    src = make_source(cfg, INPUTS, 16, base_dir=tmp_path)
    seen = [src.next_batch() for _ in range(5)]
    np.testing.assert_allclose(np.concatenate([b["features"] for b in seen]), x[:80], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.concatenate([b["label"] for b in seen]), y[:80])
    val = make_source(cfg, INPUTS, 20, base_dir=tmp_path, split="validation").next_batch()
    np.testing.assert_allclose(val["features"], x[80:], rtol=1e-6, atol=1e-6)  # the training split's statistics
    np.testing.assert_array_equal(val["label"], y[80:])
    # shuffled: an epoch is each training row once, in an order of the seed
    shuffled = make_source({**cfg, "shuffle": True}, INPUTS, 16, base_dir=tmp_path)
    epoch = np.concatenate([shuffled.next_batch()["features"] for _ in range(5)])
    want = {r.tobytes() for r in x[:80].astype(np.float32)}
    got = [r.tobytes() for r in epoch]
    assert len(set(got)) == 80 and set(got) == want


def test_statistics_and_vocabularies_come_from_the_training_split_only(tmp_path):
    cols = rows(100)
    cols["x0"][80:] += 100.0  # a held-out part unlike the training rows
    cols["age"][80:] = 999
    write(cols, tmp_path / "t.csv")
    enc = tables.learn_table({**DATA, "path": "t.csv", "validation_fraction": 0.2}, tmp_path)
    assert enc.stats["x0"] == (pytest.approx(cols["x0"][:80].mean()), pytest.approx(cols["x0"][:80].std()))
    assert enc.stats["age"][0] == pytest.approx(cols["age"][:80].mean())
    assert TableEncoding.from_json(enc.to_json()).to_json() == enc.to_json()
    # a class and a category held out only: neither is in what was learned, and reading them is an error
    cols["animal"][90] = "gnu"
    cols["color"][85] = "purple"
    write(cols, tmp_path / "t.csv")
    enc = tables.learn_table({**DATA, "path": "t.csv", "validation_fraction": 0.2}, tmp_path)
    assert "gnu" not in enc.classes and "purple" not in enc.categories["color"]
    with pytest.raises(SpecError, match=r"row 91: label 'animal' is 'gnu', a class the training split does not have"):
        make_source({**DATA, "path": "t.csv", "validation_fraction": 0.2}, INPUTS, 4, base_dir=tmp_path,
                    split="validation", table=enc)
    cols["animal"][90] = "cat"
    write(cols, tmp_path / "t.csv")
    with pytest.raises(SpecError, match=r"row 86: categorical column 'color' is 'purple'"):
        make_source({**DATA, "path": "t.csv", "validation_fraction": 0.2}, INPUTS, 4, base_dir=tmp_path,
                    split="validation", table=enc)


def test_an_unknown_label_in_a_validation_file_is_a_clear_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(rows(120), tmp_path / "table.csv")
    held = rows(40, seed=8)
    held["animal"][7] = "gnu"
    write(held, tmp_path / "held.csv")
    spec = tmp_path / "table.yaml"
    spec.write_text(spec_text(TABLE_DATA.replace("validation_fraction: 0.25", "validation: held.csv")))
    r = CliRunner().invoke(cli, ["train", str(spec), "--run-dir", str(tmp_path / "run"), "--steps", "5"])
    assert r.exit_code == SpecError.exit_code, r.output
    assert "held.csv: row 8: label 'animal' is 'gnu'" in r.output and "cat, dog, eel, fox" in r.output
    assert "Traceback" not in r.output


def test_twenty_steps_straight_equal_ten_then_resume_then_ten_and_resume_never_relearns(
        spec_file, tmp_path, monkeypatch):
    full = train(spec_file, tmp_path / "full", 20)  # 120 training rows, batch 16: 7 steps an epoch
    train(spec_file, tmp_path / "split", 10)
    stored = (tmp_path / "split" / TABLE).read_text()
    assert stored == (tmp_path / "full" / TABLE).read_text()
    for where in ("flowctl.training.inputs.learn_table", "flowctl.data.learn_table"):
        monkeypatch.setattr(where, lambda *a, **k: pytest.fail("resume learned the table again"))
    again = train(spec_file, tmp_path / "split", 20, resume=True)
    assert losses(tmp_path / "full") == losses(tmp_path / "split")  # bitwise, step by step
    assert len(losses(tmp_path / "split")) == 20
    va, vb = full.session.variable_values(), again.session.variable_values()
    for k in va:
        np.testing.assert_array_equal(va[k], vb[k], err_msg=k)
    assert (tmp_path / "split" / TABLE).read_text() == stored


def test_a_changed_file_is_read_with_the_stored_encoding_and_a_lost_one_is_refused(spec_file, tmp_path, monkeypatch):
    run = tmp_path / "run"
    first = rows(160)
    train(spec_file, run, 4)
    stored = TableEncoding.from_json((run / TABLE).read_text())
    assert stored.stats["x3"] == (pytest.approx(first["x3"][:120].mean()), pytest.approx(first["x3"][:120].std()))
    changed = rows(200, seed=1, shift=3.0)  # other rows, other means, one more epoch's worth
    write(changed, spec_file.parent / "table.csv")
    t = train(spec_file, run, 6, resume=True)
    assert t.table is not None and t.table.to_json() == stored.to_json()
    assert (run / TABLE).read_text() == stored.to_json()
    # the resumed source encodes the new rows with the first start's statistics
    mean, std = stored.stats["x3"]
    np.testing.assert_allclose(t.data.arrays["features"][:, 3], (changed["x3"][:150] - mean) / std, rtol=1e-6)
    monkeypatch.chdir(tmp_path)
    for where in ("flowctl.training.inputs.learn_table", "flowctl.data.learn_table"):
        monkeypatch.setattr(where, lambda *a, **k: pytest.fail("evaluate learned the table again"))
    r = CliRunner().invoke(cli, ["evaluate", str(run), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["examples"] == 48  # the 50 held-out rows in whole batches of 16
    r = CliRunner().invoke(cli, ["predict", str(run), str(spec_file.parent / "table.csv"), "--top", "2", "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert p["examples"] == 200 and 0 <= p["accuracy"] <= 1  # every row, the labels there too
    assert all(names == [stored.classes[i].item() for i in ids] for names, ids in zip(p["names"], p["classes"]))
    unlabelled = {k: v for k, v in changed.items() if k != "animal"}
    write(unlabelled, tmp_path / "new.parquet")
    r = CliRunner().invoke(cli, ["predict", str(run), str(tmp_path / "new.parquet"), "--json"])
    assert r.exit_code == 0, r.output
    q = json.loads(r.stdout)  # the same rows without their labels, as Parquet: the same predictions
    assert "accuracy" not in q and [c[:2] for c in q["classes"]] == p["classes"]
    (run / TABLE).write_text("{not a table")
    with pytest.raises(CheckpointError, match="table.json: damaged"):
        Trainer(load_spec(spec_file), run, prefetch=0)
    (run / TABLE).unlink()
    r = CliRunner().invoke(cli, ["resume", str(run)])
    assert r.exit_code == CheckpointError.exit_code and "table.json: missing" in r.output, r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_missing_column_is_a_located_spec_error_read_from_the_header_only(tmp_path, monkeypatch, suffix):
    write(rows(50), tmp_path / f"table{suffix}")
    spec = tmp_path / "table.yaml"
    text = spec_text(TABLE_DATA.replace("table.csv", f"table{suffix}"))
    spec.write_text(text)
    monkeypatch.setattr(tables, "read_table", lambda *a, **k: pytest.fail("the spec check read the data"))
    r = CliRunner().invoke(cli, ["validate", str(spec)])
    assert r.exit_code == 0, r.output
    lines = text.splitlines()
    spec.write_text(text.replace("x11, age", "x11, aeg").replace("label: animal", "label: animals"))
    r = CliRunner().invoke(cli, ["validate", str(spec)])
    assert r.exit_code == SpecError.exit_code, r.output
    row = next(i for i, s in enumerate(lines) if "features:" in s)
    col = lines[row].index("age") + 1
    assert f"{spec}:{row + 1}:{col}: data.features[12]: no column 'aeg' in" in r.output
    assert "did you mean 'age'?" in r.output
    row = next(i for i, s in enumerate(lines) if "label:" in s)
    assert f"{spec}:{row + 1}:{lines[row].index('animal') + 1}: data.label: no column 'animals'" in r.output
    assert "Traceback" not in r.output


def test_a_width_the_model_cannot_take_is_a_located_spec_error(spec_file, tmp_path):
    text = spec_file.read_text().replace("x11, age", "x11")  # 12 numbers and 3 colours: 15, not 16
    spec_file.write_text(text)
    lines = text.splitlines()
    row = next(i for i, s in enumerate(lines) if "features:" in s)
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", str(tmp_path / "run"), "--steps", "2"])
    assert r.exit_code == SpecError.exit_code, r.output
    assert f"{spec_file}:{row + 1}:" in r.output and "encode to 15 values" in r.output
    assert "color (one-hot 3)" in r.output and "make it [15]" in r.output
    assert not (tmp_path / "run" / TABLE).exists()


def test_without_pyarrow_a_table_spec_is_one_clear_error(spec_file, tmp_path, monkeypatch):
    for name in ("pyarrow", "pyarrow.csv", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # import pyarrow -> ImportError
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == SpecError.exit_code, r.output
    assert NEEDS in r.output and "flowctl[tables]" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "run").exists()
