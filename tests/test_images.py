"""The images source (issue 35): a folder with one sub-folder per class, decoded with Pillow on
worker processes. Every file once per epoch; crops and flips reproducible by seed and the same with
any number of workers; 20 steps straight == 10 + resume + 10 through the CLI; a corrupt file is one
error naming it (or skipped with a warning); a class-count mismatch is a located spec error;
without Pillow, one clear error naming the extra; Inception-v3 trains from a folder of JPEGs."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

Image = pytest.importorskip("PIL.Image")

from flowctl.cli.main import cli  # noqa: E402
from flowctl.data import InputSpec, make_source  # noqa: E402
from flowctl.data.images import NEEDS, ImageSource  # noqa: E402
from flowctl.engine.errors import SpecError  # noqa: E402

CLASSES, PER = 3, 8
INPUTS = [InputSpec("image", (16, 16, 3)), InputSpec("label", (), "int32", CLASSES)]


def colour(c: int, i: int) -> tuple[int, int, int]:
    """Class c's red, image i's green: every file has a colour of its own, 30 levels apart."""
    return 40 + 80 * c, 10 + 30 * i, 128


def make_folder(root: Path, fmt: str = "png", size: tuple[int, int] = (24, 20), classes: int = CLASSES,
                per: int = PER) -> Path:
    """classes x per images of size (w, h): each file's colour plus +-10 of noise, so crops and
    flips change the pixels (JPEG keeps a colour within a few levels)."""
    for c in range(classes):
        d = root / f"class_{c}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per):
            a = np.empty((size[1], size[0], 3))
            a[...] = colour(c, i)
            a += np.random.default_rng([c, i]).integers(-10, 11, a.shape)
            Image.fromarray(a.clip(0, 255).astype(np.uint8)).save(d / f"img{i}.{fmt}", quality=95)
    return root


def source(folder: Path, **cfg) -> ImageSource:
    return make_source({"source": "images", "path": str(folder), **cfg}, INPUTS, 4)


def identify(x: np.ndarray) -> tuple[int, int]:
    """(class, image) of a decoded example (pixels in [0, 1]) from its mean colour."""
    r, g, _ = (x.reshape(-1, 3).mean(0) * 255)
    return round((r - 40) / 80), round((g - 10) / 30)


@pytest.mark.parametrize("fmt", ["png", "jpg"])
def test_every_file_is_seen_once_per_epoch_with_its_class(tmp_path, fmt):
    src = source(make_folder(tmp_path / "imgs", fmt), workers=2)
    assert src.classes == ["class_0", "class_1", "class_2"] and src.batches_per_epoch == 6
    try:
        epochs = []
        for _ in range(2):
            seen = []
            for _ in range(src.batches_per_epoch):
                b = src.next_batch()
                assert b["image"].shape == (4, 16, 16, 3) and b["image"].dtype == np.float32
                assert b["label"].dtype == np.int32
                for x, y in zip(b["image"], b["label"]):
                    c, i = identify(x)
                    assert c == y
                    seen.append((c, i))
            assert sorted(seen) == [(c, i) for c in range(CLASSES) for i in range(PER)]
            epochs.append(seen)
        assert epochs[0] != epochs[1]  # a fresh order each epoch
    finally:
        src.close()


def batches(src: ImageSource, n: int) -> list[dict[str, np.ndarray]]:
    try:
        return [src.next_batch() for _ in range(n)]
    finally:
        src.close()


def test_crops_and_flips_are_fixed_by_the_seed_not_by_the_workers(tmp_path):
    folder = make_folder(tmp_path / "imgs", "jpg")
    aug = dict(crop="random", flip=True, resize=20, mean=[0.5, 0.4, 0.3], std=[0.2])
    runs = {w: batches(source(folder, workers=w, seed=7, **aug), 13) for w in (0, 1, 2)}
    for w in (1, 2):
        for a, b in zip(runs[0], runs[w]):
            np.testing.assert_array_equal(a["image"], b["image"])
            np.testing.assert_array_equal(a["label"], b["label"])
    other = batches(source(folder, workers=0, seed=8, **aug), 13)
    assert any(not np.array_equal(a["image"], b["image"]) for a, b in zip(runs[0], other))
    # The augmentation is real: a file's pixels differ from one epoch to the next (crop, flip) ...
    plain = batches(source(folder, workers=0, seed=7, resize=20, mean=[0.5, 0.4, 0.3], std=[0.2]), 12)
    by_file = {}
    for k, b in enumerate(runs[0][:12]):
        for x in b["image"]:
            by_file.setdefault(identify(x * 0.2 + np.float32([0.5, 0.4, 0.3])), []).append(x)
    assert all(len(v) == 2 for v in by_file.values())
    assert sum(not np.array_equal(a, b) for a, b in by_file.values()) >= 20
    # ... and without it the same file is the same array every epoch.
    again = {}
    for b in plain:
        for x in b["image"]:
            again.setdefault(identify(x * 0.2 + np.float32([0.5, 0.4, 0.3])), []).append(x)
    assert all(np.array_equal(a, b) for a, b in again.values())


def test_a_restored_cursor_continues_with_the_same_images_crops_and_flips(tmp_path):
    folder = make_folder(tmp_path / "imgs")
    cfg = dict(crop="random", flip=True, workers=2, seed=3)
    straight = batches(source(folder, **cfg), 10)
    first = source(folder, **cfg)
    batches_ = [first.next_batch() for _ in range(4)]
    state = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
    first.close()
    second = source(folder, **cfg)
    second.restore(state)
    rest = batches(second, 6)
    for a, b in zip(straight, batches_ + rest):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])


SPEC = """\
version: 1
name: tiny_images
model:
  layers:
    - {name: image, type: input, shape: [16, 16, 3]}
    - {name: conv, type: conv2d, filters: 4, kernel: 3, activation: relu}
    - {name: pool, type: global_avg_pool}
    - {name: logits, type: dense, units: 3}
    - {name: label, type: input, shape: [], dtype: int32, classes: CLASSES}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, label]}
data:
  source: images
  path: imgs
  crop: random
  flip: true
  resize: 18
  mean: [0.5, 0.5, 0.5]
  std: [0.25]
  workers: 2
  seed: 5
  validation_fraction: 0.25
training:
  optimizer: {type: momentum}
  learning_rate: 0.1
  batch_size: 4
  steps: 20
  seed: 1
  eval_every_steps: 5
  metrics: [loss, accuracy]
checkpoint: {every_steps: 100}
"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    make_folder(tmp_path / "imgs", "jpg")
    p = tmp_path / "tiny_images.yaml"
    p.write_text(SPEC.replace("CLASSES", str(CLASSES)))
    return p


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_twenty_steps_straight_equal_ten_then_resume_then_ten(spec_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    r = runner.invoke(cli, ["train", str(spec_file), "--run-dir", "full"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["train", str(spec_file), "--run-dir", "split", "--steps", "10"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["resume", "split", "--steps", "20"])
    assert r.exit_code == 0, r.output
    assert "data epoch 2 batch 2" in r.output  # 18 training images: 4 batches an epoch, 10 = 2 x 4 + 2
    full, split = records(tmp_path / "full"), records(tmp_path / "split")
    losses = [x["loss"] for x in full if "loss" in x]
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
    assert losses == [x["loss"] for x in split if "loss" in x]  # bitwise
    val = [(x["step"], x["val/loss"], x["val/accuracy"]) for x in full if "val/loss" in x]
    assert len(val) == 4 and val == [(x["step"], x["val/loss"], x["val/accuracy"]) for x in split if "val/loss" in x]


def test_a_corrupt_file_is_one_error_naming_it_or_skipped_with_a_warning(tmp_path, spec_file, monkeypatch):
    folder = tmp_path / "imgs"
    bad = folder / "class_1" / "broken.jpg"
    bad.write_bytes(b"not an image at all" * 10)
    with pytest.raises(SpecError, match="broken.jpg: cannot read image") as e:
        source(folder, workers=2)
    assert "on_corrupt: skip" in str(e.value)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", "run", "--steps", "2"])
    assert r.exit_code == SpecError.exit_code and "broken.jpg" in r.output and "Traceback" not in r.output, r.output

    with pytest.warns(UserWarning, match="broken.jpg: cannot read image .*left out"):
        src = source(folder, workers=2, on_corrupt="skip")
    assert src.n == CLASSES * PER and str(bad) not in src.files
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", "skip", "--steps", "2",
                                 "--set", "data.on_corrupt=skip"])
    assert r.exit_code == 0 and "broken.jpg" in r.output, r.output
    src.close()


def test_a_file_cut_short_fails_when_decoded_or_is_replaced_by_the_next(tmp_path):
    folder = make_folder(tmp_path / "imgs", "png", classes=CLASSES, per=4)
    cut = folder / "class_0" / "img0.png"
    cut.write_bytes(cut.read_bytes()[:200])  # the header reads; the pixels do not
    src = source(folder, workers=0, shuffle=False)
    with pytest.raises(SpecError, match="img0.png: cannot decode image"):
        src.next_batch()
    src = source(folder, workers=0, shuffle=False, on_corrupt="skip")
    with pytest.warns(UserWarning, match="img0.png: cannot decode image"):
        b = src.next_batch()
    assert [identify(x) for x in b["image"]] == [(0, 1), (0, 1), (0, 2), (0, 3)]


def test_a_class_count_mismatch_is_a_located_spec_error(tmp_path, spec_file):
    spec_file.write_text(SPEC.replace("CLASSES", "4"))
    r = CliRunner().invoke(cli, ["validate", str(spec_file)])
    assert r.exit_code == SpecError.exit_code, r.output
    assert "tiny_images.yaml:13:" in r.output and "3 class sub-folder(s)" in r.output, r.output
    assert "takes 4 classes" in r.output and "Traceback" not in r.output


def test_bad_image_keys_are_located_spec_errors(tmp_path, spec_file):
    text = SPEC.replace("CLASSES", "3")
    for old, new, why in (("std: [0.25]", "std: [0.25, 0.5]", "std takes 1 or 3 values"),
                          ("crop: random", "crop: middle", "crop"),
                          ("path: imgs", "path: nowhere", "no such folder"),
                          ("  seed: 5", "  seed: 5\n  input: label", "must be float [H, W, 1 or 3]")):
        spec_file.write_text(text.replace(old, new))
        r = CliRunner().invoke(cli, ["validate", str(spec_file)])
        assert r.exit_code == SpecError.exit_code, r.output
        assert "tiny_images.yaml:" in r.output and why in r.output and "Traceback" not in r.output, r.output


def test_without_pillow_an_images_spec_is_one_clear_error(tmp_path, spec_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # from PIL import Image -> ImportError
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == SpecError.exit_code, r.output
    assert NEEDS in r.output and "Traceback" not in r.output


@pytest.mark.slow
def test_inception_v3_trains_from_a_folder_of_jpegs(tmp_path, monkeypatch):
    make_folder(tmp_path / "jpegs", "jpg", size=(299, 299), classes=2, per=2)
    spec = Path(__file__).resolve().parent.parent / "specs" / "inception_v3.yaml"
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, [
        "train", str(spec), "--run-dir", "run", "--steps", "2", "--json",
        "--set", f"data={{source: images, path: {tmp_path / 'jpegs'}, crop: random, flip: true, "
                 f"mean: [0.5], std: [0.5]}}",
        "--set", "training.batch_size=2", "--set", "model.layers.label.classes=2",
        "--set", "model.layers.logits.units=2"])
    assert r.exit_code == 0, r.output
    losses = [x["loss"] for x in records(tmp_path / "run") if "loss" in x]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


def test_bench_reports_images_per_second_beside_the_models_examples_per_second(spec_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["bench", str(spec_file), "--quick", "--algorithms", "single", "--json",
                                 "--out", "bench.json"])
    assert r.exit_code == 0, r.output
    inp = json.loads((tmp_path / "bench.json").read_text())["input"]
    assert inp["size"] == [16, 16] and inp["workers"] == 2 and inp["files"] == 18
    assert inp["images_per_s"] > 0 and inp["model_examples_per_s"] > 0
    assert inp["limits"] == ("input" if inp["images_per_s"] < inp["model_examples_per_s"] else "model")
    assert "images/s decoded and augmented at 16x16" in r.output


def test_data_points_train_and_evaluate_at_a_folder(spec_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = make_folder(tmp_path / "other", "png")
    r = CliRunner().invoke(cli, ["train", str(spec_file), "--run-dir", "run", "--steps", "2", "--data", str(other)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["evaluate", "run", "--data", str(other), "--json"])
    assert r.exit_code == 0, r.output
    scores = json.loads(r.stdout)
    assert math.isfinite(scores["val/loss"]) and 0 <= scores["val/accuracy"] <= 1, scores
